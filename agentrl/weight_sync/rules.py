"""What a transport needs from where the run's parts are: the checks a config must pass (run when it
loads, :func:`check_transport`) and the environment the trainer's processes need to meet the engines
(:func:`trainer_env`)."""

from __future__ import annotations

# SGLang's scheduler processes set NCCL_CUMEM_ENABLE=0 (unless symmetric memory is on); NCCL's peer
# transport then shares buffers by legacy CUDA IPC, and a process at the other end of a weight-update
# group that runs with NCCL's default (cuMem) fails to open them: "Cuda failure 'invalid argument'" in
# /update_weights_from_distributed. The trainer's processes run with the same setting (NCCL reads it once,
# so it must be in their environment from the start).
SGLANG_PEER_ENV = {"NCCL_CUMEM_ENABLE": "0"}


def check_transport(
    transport: str,
    *,
    colocated: bool,
    on_gpus: bool,
    trainer_on_gpu: bool,
    engine_backend: str,
    placed_apart: bool = False,
) -> None:
    """A ValueError naming ``weight_sync`` when ``transport`` cannot reach the engines from where the run
    puts them: ``colocated`` (engine i beside trainer rank i), ``on_gpus`` (engines and trainer on GPUs),
    ``trainer_on_gpu``, the engines' ``engine_backend``, and ``placed_apart`` (the engines and the trainer
    ranks ask for different custom Ray resources, so they may sit on different hosts)."""
    if transport == "tensor" and placed_apart and not colocated:
        raise ValueError(
            "weight_sync: tensor hands weights over in memory on one machine, but ray.engine_resources "
            "and ray.trainer_resources place the engines and the trainer ranks on nodes of their own; "
            "use distributed (or disk on a file system both see)"
        )
    if colocated and on_gpus and transport == "distributed":
        raise ValueError(
            "weight_sync: NCCL cannot broadcast between two processes on one GPU; "
            "use weight_sync: tensor (or disk) when colocated"
        )
    if transport == "tensor" and trainer_on_gpu and not colocated:
        raise ValueError(
            "weight_sync: tensor passes CUDA IPC handles, which open only on the trainer's own GPU; "
            "with placement disaggregated use distributed"
        )
    if transport == "tensor" and engine_backend == "external":
        raise ValueError(
            "weight_sync: tensor hands weights over in memory to engines this run starts on its own "
            "machine; engine.backend external may be elsewhere: use disk or distributed"
        )


def trainer_env(engine_backend: str) -> dict[str, str]:
    """What the trainer ranks' environment needs for the run's engines: with SGLang, the NCCL setting its
    servers run with (:data:`SGLANG_PEER_ENV`), so that a weight-update group between the two opens."""
    return dict(SGLANG_PEER_ENV) if engine_backend == "sglang" else {}
