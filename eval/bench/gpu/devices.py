"""Dense bf16 tensor-core peaks of common GPUs: the denominator of `vlm bench gpu`'s MFU.

Every figure is the vendor's *dense* BF16 tensor-core peak (FP32 accumulate) in TFLOP/s, never the
"with sparsity" figure the datasheets print next to it (2x the dense one). Sources:
- H100 SXM / PCIe / NVL, H200 SXM / NVL: NVIDIA H100 and H200 Tensor Core GPU datasheets (BF16
  Tensor Core 1,979 / 1,513 / 1,671 TFLOPS with sparsity -> 989.4 / 756.5 / 835.5 dense; H200 as
  H100 SXM, H200 NVL as H100 NVL). H800 / H800 PCIe: the H100 SXM / PCIe silicon and clocks (export
  variants with reduced NVLink).
- GH200: NVIDIA GH200 Grace Hopper Superchip datasheet (its Hopper GPU: 989 dense,
  1,979 with sparsity).
- A100 (SXM4 and PCIe, 40 and 80 GB) and A800: NVIDIA A100 datasheet (BF16 Tensor Core 312,
  624 with sparsity).
- L40S: NVIDIA L40S datasheet (BF16 Tensor Core 362.05, 733 with sparsity). L40: NVIDIA L40
  datasheet (181.05, 362.1 with sparsity). L4: NVIDIA L4 datasheet (121, 242 with sparsity).
- A10: NVIDIA A10 datasheet (BF16 Tensor Core 125, 250 with sparsity). A10G (AWS g5): AWS
  publishes no datasheet; the figure is the A10's, marked approximate (the A10G's clocks differ
  from the A10's).
- RTX 4090: NVIDIA Ada Lovelace architecture whitepaper, appendix (Peak BF16 Tensor TFLOPS with FP32
  Accumulate 165.2, 330.4 with sparsity; the 330 figure without sparsity is FP16 with FP16
  accumulate, not what bf16 training runs).
- B200: NVIDIA HGX B200 datasheet (FP16/BF16 Tensor Core 4.5 PFLOPS per GPU with sparsity
  -> 2,250 dense).

A device is matched by a table key found in `torch.cuda.get_device_name()` as a whole word (so
"H200" does not match "GH200", "L4" not "L40S", "A100" not "RTX A1000"); the first match wins, so
"H100 PCIe" precedes "H100". An unknown device gets no peak: MFU is then reported as null with a
note naming the device.
"""

from __future__ import annotations

import re

# (word(s) in the CUDA device name, what it is, dense bf16 TFLOP/s, approximate?)
PEAK_BF16_TFLOPS: tuple[tuple[str, str, float, bool], ...] = (
    ("GH200", "NVIDIA GH200 (Hopper GPU)", 989.4, False),
    ("H200 NVL", "NVIDIA H200 NVL", 835.5, False),
    ("H200", "NVIDIA H200 SXM", 989.4, False),
    ("H100 PCIe", "NVIDIA H100 PCIe", 756.5, False),
    ("H100 NVL", "NVIDIA H100 NVL", 835.5, False),
    ("H100", "NVIDIA H100 SXM", 989.4, False),  # "NVIDIA H100 80GB HBM3" is the SXM part
    ("H800 PCIe", "NVIDIA H800 PCIe", 756.5, False),
    ("H800", "NVIDIA H800 SXM", 989.4, False),
    ("B200", "NVIDIA B200", 2250.0, False),
    ("A100", "NVIDIA A100", 312.0, False),
    ("A800", "NVIDIA A800", 312.0, False),
    ("A10G", "NVIDIA A10G (AWS)", 125.0, True),
    ("A10", "NVIDIA A10", 125.0, False),
    ("L40S", "NVIDIA L40S", 362.05, False),
    ("L40", "NVIDIA L40", 181.05, False),
    ("L4", "NVIDIA L4", 121.0, False),
    ("RTX 4090", "NVIDIA GeForce RTX 4090", 165.2, False),
)


def peak_bf16(device_name: str) -> dict | None:
    """{'match', 'device', 'tflops', 'flops', 'approximate'} for a CUDA device name, or None when not in the table."""
    for key, what, tflops, approx in PEAK_BF16_TFLOPS:
        if re.search(rf"(?<![a-z0-9]){re.escape(key.lower())}(?![a-z0-9])", device_name.lower()):
            return {
                "match": key,
                "device": what,
                "tflops": tflops,
                "flops": tflops * 1e12,
                "approximate": approx,
            }
    return None
