"""Pipeline parallelism: the split of a decoder into stages and torch's schedules over them.

Plain torch.distributed (``torch.distributed.pipelining``); never imports Lightning.
"""
