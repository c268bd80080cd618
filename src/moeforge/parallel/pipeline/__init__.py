"""Pipeline parallelism: stages carved from a built model, driven by torch.distributed.pipelining schedules."""
