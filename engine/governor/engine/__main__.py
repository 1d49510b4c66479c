import sys

from governor.engine.cli import main

sys.exit(main())
