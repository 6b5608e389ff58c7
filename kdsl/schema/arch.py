"""What each GPU architecture can do, as far as kernel definitions care."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchFacts:
    cc: int
    max_shared_bytes: int  # opt-in dynamic shared memory per block
    fp8_tensor_cores: bool
    tma: bool
    wgmma: bool


ARCH_FACTS: dict[int, ArchFacts] = {
    80: ArchFacts(80, 163 * 1024, fp8_tensor_cores=False, tma=False, wgmma=False),
    86: ArchFacts(86, 99 * 1024, fp8_tensor_cores=False, tma=False, wgmma=False),
    89: ArchFacts(89, 99 * 1024, fp8_tensor_cores=True, tma=False, wgmma=False),
    90: ArchFacts(90, 227 * 1024, fp8_tensor_cores=True, tma=True, wgmma=True),
    # Named so variants can say where they fall back to; no kdsl kernel targets
    # Blackwell's own instructions yet.
    100: ArchFacts(100, 227 * 1024, fp8_tensor_cores=True, tma=True, wgmma=False),
    120: ArchFacts(120, 99 * 1024, fp8_tensor_cores=True, tma=True, wgmma=False),
}


def archs_in_range(min_cc: int, max_cc: int | None) -> list[ArchFacts]:
    return [f for cc, f in sorted(ARCH_FACTS.items()) if cc >= min_cc and (max_cc is None or cc <= max_cc)]
