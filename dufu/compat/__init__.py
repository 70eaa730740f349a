"""Compatibility APIs: other frameworks' vocabularies spoken on dufu's own machinery.

``dufu.compat.libai`` is LiBai's global view (placement + SBP) on DeviceMesh and DTensor, for code ported
from LiBai (``from dufu.compat import libai as dist``). dufu's own code never imports this package.
"""
