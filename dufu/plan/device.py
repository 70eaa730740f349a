"""One device as the cost model sees it: the :class:`Hardware` record of its figures and model constants.

Where the figures come from is elsewhere: published ones in the catalog and user files (:mod:`dufu.plan.hardware`),
this machine's CPU measured (:mod:`dufu.plan.cpu`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class Hardware:
    """One device (a GPU, or a CPU running one process per "device") and the constants the cost model uses.

    Bandwidths are bytes/s per device and direction; ``peak_flops`` are dense FLOP/s by dtype name."""

    name: str
    description: str
    peak_flops: dict  # {"bf16": ..., "fp16": ..., "fp32": ...}
    memory_bytes: float
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    devices_per_node: int = 8
    # ---- model constants (not published figures). The defaults describe an ideal device (kernels at the peaks, no
    # host time or latency, nothing overlapped); a GPU takes dufu.plan.hardware.GPU_CONSTANTS (fitted to published
    # training results), the CPU its measured figures (dufu.plan.cpu).
    gemm_efficiency: float = 1.0  # a matmul whose every dimension is large runs at this fraction of the peak ...
    gemm_half_size: float = 0.0  # ... and each dimension d scales that by d / (d + gemm_half_size)
    # fused attention's fraction of the dense peak (times f(T) f(Tk) for T queries and Tk keys; not f(head dim))
    attention_efficiency: float = 1.0
    memory_efficiency: float = 1.0  # fraction of memory bandwidth elementwise kernels reach
    comm_efficiency: float = 1.0  # fraction of link bandwidth collectives reach (NCCL bus bandwidth)
    op_overhead_s: float = 0.0  # host time to launch one op (hidden behind device work on GPUs)
    param_op_overhead_s: float = 0.0  # extra host time of an op on DTensor parameters (tensor parallelism)
    intra_latency_s: float = 0.0  # per step of a ring collective inside a node (NCCL's low-latency protocols)
    inter_latency_s: float = 0.0  # per step between nodes
    overlap: float = 0.0  # share of overlappable communication (FSDP/DDP) hidden behind compute
    reserved_bytes: float = 3e9  # what the runtime keeps (CUDA context, allocator fragmentation)
    synchronous: bool = False  # True on a CPU: op dispatch and communication are on the critical path
    cores: int = 0  # CPU: cores the processes share
    thread_flops: dict = field(default_factory=dict)  # CPU: {threads: {dtype: FLOP/s}} of a large matmul
    # Elementwise ops (bytes read + written per second). On a GPU they are bound by memory bandwidth alike; on a
    # CPU an op with transcendentals (GELU's tanh, exp in softmax, a norm's rsqrt) computes slower than memory
    # feeds it, so the two kinds are measured apart. 0: memory_bandwidth x memory_efficiency.
    elementwise_bandwidth: float = 0.0
    transcendental_bandwidth: float = 0.0
    optimizer_bandwidth: float = 0.0  # fused AdamW's bytes per second (0: memory_bandwidth x memory_efficiency)
    # CPU: seconds of a real forward + backward of CALIBRATION_MODEL by thread count; the cost model's own
    # prediction for it turns them into a factor on computation time (what per-op pricing leaves out: caches
    # cooled by the ops in between, the autograd engine, the allocator)
    calibration: dict = field(default_factory=dict)
    # CPU: bytes/s of memory fresh from the system (page faults); paid by every allocation of at least
    # $MALLOC_MMAP_THRESHOLD_ bytes when that is set in the planning process, as for the runs it predicts
    page_fault_bandwidth: float = 0.0
    # CPU (gloo): bus bytes/s of an all-gather of unit-sized buffers, measured apart from the all-reduce's: gloo's
    # all-gather of tens of MB runs at a third of its all-reduce's rate (0: the link bandwidth)
    all_gather_bandwidth: float = 0.0
    source: str = ""
    measured: bool = False

    def peak(self, dtype: str, threads: int = 0) -> float:
        """Dense peak FLOP/s in ``dtype`` ("fp32", "bf16", "fp16"), for ``threads`` threads on a CPU."""
        if self.thread_flops and threads:
            table = self.thread_flops.get(threads) or self.thread_flops.get(str(threads))
            if table and dtype in table:
                return table[dtype]
        return self.peak_flops.get(dtype) or self.peak_flops.get("bf16" if dtype == "fp16" else "fp32")

    def thread_scale(self, threads: int) -> float:
        """A CPU's speed-up on ``threads`` threads over one (its measured large-matmul ratio); 1 on a GPU."""
        if not self.thread_flops or threads <= 1:
            return 1.0
        one = self.thread_flops.get(1) or self.thread_flops.get("1")
        many = self.thread_flops.get(threads) or self.thread_flops.get(str(threads))
        if not one or not many:
            return 1.0
        return many["fp32"] / one["fp32"]

    def rates(self, threads: int = 0) -> dict:
        """Bytes per second of a streaming copy (memory bandwidth), simple and transcendental elementwise ops and
        the optimizer step."""
        base = self.memory_bandwidth * self.memory_efficiency
        scale = self.thread_scale(threads)
        return {"stream": self.memory_bandwidth * self.memory_efficiency * (scale if not self.cores else 1.0),
                "elementwise": (self.elementwise_bandwidth or base) * scale,
                "transcendental": (self.transcendental_bandwidth or self.elementwise_bandwidth or base) * scale,
                "optimizer": (self.optimizer_bandwidth or base) * scale}

    def describe(self) -> str:
        bf16 = self.peak("bf16") / TFLOPS
        return (f"{self.name}: {self.description}; {bf16:,.3g} TFLOP/s bf16, {self.peak('fp32') / TFLOPS:,.3g} fp32, "
                f"{self.memory_bytes / GB:,.0f} GB at {self.memory_bandwidth / GB:,.0f} GB/s, links "
                f"{self.intra_node_bandwidth / GB:,.3g} GB/s in a node, {self.inter_node_bandwidth / GB:,.3g} GB/s "
                f"between nodes")


def as_dict(hw: Hardware) -> dict:
    """The hardware's figures (for --json)."""
    d = asdict(hw)
    d["thread_flops"] = {str(k): v for k, v in hw.thread_flops.items()}
    return d
