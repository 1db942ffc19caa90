"""Pipeline parallelism: a model's layers split over processes or hosts (docs/scale-out.md).

Rank 0 holds the engine (scheduler, block pool, sessions: the one owner of KV state) and the first
stage; every rank holds a contiguous range of layers and its own paged KV pool for them, with the
same block ids. Rank 0 decides each step once and sends its plan with the activations down the
pipeline over `torch.distributed` point-to-point (gloo on CPUs); the last stage samples and sends the
tokens back. With several steps in flight the stages work on different micro-batches at once.

    topology.py   Topology: how many stages, on which hosts, this process's ranks (flags or torchrun's env)
    wire.py       one message between stages: a header, a pickled plan or result, a tensor
    rendezvous.py the TCPStore meeting: versions and model fingerprints compared, the process group
    stage.py      a stage's share of the model and its step (any rank)
    runner.py     PipelineRunner: rank 0's side, the engine's Runner
    worker.py     ranks 1.. : the loop that receives, computes and passes on
"""
