"""Published peak rates of the GPUs the roofline models, and the constants fitted to measured steps.

Dense rates (no structured sparsity), boost clocks, from NVIDIA's data sheets:

* H100 SXM5 80 GB and H100 PCIe 80 GB: "NVIDIA H100 Tensor Core GPU" data sheet
  (https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet), table "Technical Specifications";
  the sheet's tensor-core rates are "with sparsity", halved here.
* H200 SXM 141 GB: "NVIDIA H200 Tensor Core GPU" product page and data sheet (https://www.nvidia.com/en-us/data-center/h200/):
  the H100 SXM's compute with 4.8 TB/s of HBM3e.
* A100 SXM4 80 GB: "NVIDIA A100 Tensor Core GPU" data sheet
  (https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf).
* L4 24 GB: "NVIDIA L4 Tensor Core GPU" data sheet
  (https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet); FP64 at 1/64 of FP32 (Ada Lovelace).
"""

from __future__ import annotations

from dataclasses import dataclass

TERA = 1e12


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model: peak rates in FLOP/s (dense), memory bandwidth in bytes/s, compute capability."""

    name: str
    capability: tuple[int, int]
    memory_gib: float
    bandwidth: float  # HBM / GDDR bytes per second
    bf16_tensor: float  # bf16 / fp16 tensor-core products, float32 accumulation
    tf32_tensor: float  # float32 products with TF32 allowed
    fp32: float  # float32 without tensor cores (CUDA cores)
    fp64_tensor: float  # float64 products (DGEMM on the tensor cores where the GPU has them)
    fp64: float  # other float64 work (factorisations, elementwise)
    host_link: float  # host <-> device copies, bytes per second (PCIe, one direction)
    multiprocessors: int  # streaming multiprocessors (what torch.cuda.get_device_properties reports)
    source: str

    def peak(self, dtype_class: str) -> float:
        """FLOP/s of one of the classes :func:`~.counts.rate_class` returns."""
        return {
            "bf16_tensor": self.bf16_tensor,
            "tf32_tensor": self.tf32_tensor,
            "fp32": self.fp32,
            "fp64_tensor": self.fp64_tensor,
            "fp64": self.fp64,
        }[dtype_class]


GPUS: dict[str, GPUSpec] = {
    "h100-sxm": GPUSpec(
        name="NVIDIA H100 SXM5 80GB", capability=(9, 0), memory_gib=80, bandwidth=3.35 * TERA,
        bf16_tensor=989.4 * TERA, tf32_tensor=494.7 * TERA, fp32=66.9 * TERA, fp64_tensor=66.9 * TERA,
        fp64=33.5 * TERA, host_link=64e9, multiprocessors=132, source="H100 data sheet, SXM5 column",
    ),
    "h100-pcie": GPUSpec(
        name="NVIDIA H100 PCIe 80GB", capability=(9, 0), memory_gib=80, bandwidth=2.0 * TERA,
        bf16_tensor=756.0 * TERA, tf32_tensor=378.0 * TERA, fp32=51.2 * TERA, fp64_tensor=51.2 * TERA,
        fp64=25.6 * TERA, host_link=64e9, multiprocessors=114, source="H100 data sheet, PCIe column",
    ),
    "h200": GPUSpec(
        name="NVIDIA H200", capability=(9, 0), memory_gib=141, bandwidth=4.8 * TERA,
        bf16_tensor=989.4 * TERA, tf32_tensor=494.7 * TERA, fp32=66.9 * TERA, fp64_tensor=66.9 * TERA,
        fp64=33.5 * TERA, host_link=64e9, multiprocessors=132, source="H200 data sheet, SXM column",
    ),
    "a100": GPUSpec(
        name="NVIDIA A100-SXM4-80GB", capability=(8, 0), memory_gib=80, bandwidth=2.039 * TERA,
        bf16_tensor=312.0 * TERA, tf32_tensor=156.0 * TERA, fp32=19.5 * TERA, fp64_tensor=19.5 * TERA,
        fp64=9.7 * TERA, host_link=32e9, multiprocessors=108, source="A100 data sheet, 80GB SXM column",
    ),
    "l4": GPUSpec(
        name="NVIDIA L4", capability=(8, 9), memory_gib=24, bandwidth=0.3 * TERA,
        bf16_tensor=121.0 * TERA, tf32_tensor=60.0 * TERA, fp32=30.3 * TERA, fp64_tensor=0.47 * TERA,
        fp64=0.47 * TERA, host_link=32e9, multiprocessors=58, source="L4 data sheet",
    ),
}  # fmt: skip


# The GPU models above by the words of their CUDA device names (``torch.cuda.get_device_name``).
_NAMES = (("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("a100", "a100"), (" l4", "l4"))


def gpu_key(device_name: str) -> str | None:
    """The key of :data:`GPUS` for a CUDA device (``NVIDIA H100 80GB HBM3`` -> ``h100-sxm``), None for a GPU not
    modelled."""
    name = f" {device_name.lower()}"
    return next((model for words, model in _NAMES if words in name), None)


@dataclass(frozen=True)
class Calibration:
    """The two constants fitted to measured steps: the fraction of the peak rates a kernel reaches (compute and
    memory alike) and the time every kernel costs on top of its work (launch, the eager dispatch that issues it,
    the tail of a small grid), in seconds."""

    efficiency: float
    launch_floor: float
    fitted_on: str


# A short kernel replayed in a CUDA graph: the per-kernel time of the graph-launched ~3 us kernels in NVIDIA's "Getting
# Started with CUDA Graphs" (https://developer.nvidia.com/blog/cuda-graphs/), 3.4 us. Published, not fitted: the H200
# report's compiled-costs rows are not traced (inductor's fusion is not modelled).
GRAPH_KERNEL_FLOOR = 3.4e-6

# Fitted by ``python benchmarks/roofline.py --calibrate`` on the six step rows of docs/benchmarks/gpu-nvidia-h200.md
# (code of commit 9fe80ea); the table and the fit are in docs/benchmarks/roofline.md.
CALIBRATION = Calibration(
    efficiency=0.994,
    launch_floor=34.48e-6,
    fitted_on="fitted on the H200 report's six step rows, code of commit 9fe80ea",
)
