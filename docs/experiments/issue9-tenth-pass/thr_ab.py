"""governor's command line with the fp8 decode kernel chosen by GLUON_DECODE (1: the Gluon kernel, as shipped; 0: the
Triton kernel everywhere), for an A/B of the engine's throughput on one machine (call 9)."""

import os
import sys

import governor.kernels.paged_attention as pa
from governor.engine.cli import main

pa._GLUON_DECODE = os.environ.get("GLUON_DECODE", "1") == "1"
sys.exit(main())
