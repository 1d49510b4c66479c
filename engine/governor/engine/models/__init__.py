"""Model families the engine runs, and random-weight checkpoints of them (`make_model`)."""
