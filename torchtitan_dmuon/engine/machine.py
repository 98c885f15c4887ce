"""The GPU model the planner and the plan report weigh a step's work with.

A model, not a measurement: dense bf16 peak FLOP/s and link bandwidths from the data
sheets, ring collectives, no overlap. The planner uses it to decide when an owner group
pays (its members split a matrix's Newton-Schulz but all-reduce a Gram every step); the
plan report (``titan/plan_report.py``) to set a step's Newton-Schulz and bytes beside its
forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_GPU", "GPU", "GPUS"]


@dataclass(frozen=True)
class GPU:
    """The stated inputs of the model.

    Attributes:
        name: What it is.
        peak_tflops: Dense bf16 peak, 10^12 FLOP/s.
        link_gbytes: Bandwidth of one GPU's traffic across nodes, 10^9 bytes/s each way
            (its share of the node's network).
        node_link_gbytes: Bandwidth of one GPU's traffic within its node (NVLink), 10^9
            bytes/s each way.
        gpus_per_node: GPUs that share a node's NVLink (consecutive ranks).
        ns_bytes: Bytes of an element of Newton-Schulz on it (bf16).
    """

    name: str
    peak_tflops: float
    link_gbytes: float
    node_link_gbytes: float
    gpus_per_node: int = 8
    ns_bytes: int = 2

    def all_reduce_seconds(self, nbytes: int, ranks: int) -> float:
        """A ring all-reduce of ``nbytes`` over ``ranks`` consecutive ranks: each sends
        ``2 (ranks - 1) / ranks`` of it, over NVLink when they share a node."""
        if ranks <= 1:
            return 0.0
        bandwidth = self.node_link_gbytes if ranks <= self.gpus_per_node else self.link_gbytes
        return 2 * (ranks - 1) / ranks * nbytes / (bandwidth * 1e9)

    def as_flops(self, seconds: float) -> int:
        """The FLOPs the GPU runs at peak in ``seconds`` (one unit for work and waits)."""
        return round(seconds * self.peak_tflops * 1e12)


GPUS = {
    # Data sheets: dense bf16 peak; NVLink each way (H100 SXM 900 GB/s, A800 SXM 400 GB/s
    # both ways); one 400 Gb/s NIC per GPU on H100 nodes, one 200 Gb/s on A800 nodes.
    "H100": GPU("H100 SXM", 989.0, 50.0, 450.0),
    "A800": GPU("A800 SXM", 312.0, 25.0, 200.0),
}

DEFAULT_GPU = GPUS["H100"]
"""What the planner weighs owner groups with unless told otherwise."""
