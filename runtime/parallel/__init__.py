"""Tensor-parallel serving on one machine: the engine's process is rank 0 (it schedules and
samples); `launch.start_ranks` starts the other ranks as processes that follow its steps
(worker.py), over a torch.distributed gloo group (group.py) whose collectives time out."""
