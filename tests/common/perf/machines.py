"""Machine profiles the performance-model tests build by hand."""

from common.perf.machine import Compute, Link, MachineProfile


def tiny_gpu(device_memory: float) -> MachineProfile:
    """A GPU node whose every rate is 1e9 (bytes/s or flop/s) and whose device holds
    ``device_memory`` bytes: small enough that a 20,000-node graph does not fit everywhere."""
    link = Link(alpha_s=0, bandwidth=1e9)
    return MachineProfile(name="tiny", node_memory=1e12, device_memory=device_memory,
                          intra=link, inter=link,
                          compute=(Compute(spmm_bandwidth=1e9, gemm_flops=1e9,
                                           memory_bandwidth=1e9),))
