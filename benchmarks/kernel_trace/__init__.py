"""A kernel-level roofline of a training step, traced on a CPU (``benchmarks/roofline.py``).

One training step runs on fake tensors (no arithmetic) while the code takes the branches it takes on the modelled CUDA
GPU (:mod:`.modelled_gpu`); every ATen operation that launches a kernel is recorded with its FLOPs, bytes, dtype,
tensor-core eligibility and source line (:mod:`.recorder`), and its time predicted from one table of published peak
rates (:mod:`.gpus`, :mod:`.predict`).
"""
