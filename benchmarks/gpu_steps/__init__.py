"""The steps of ``benchmarks/gpu.py``: the shared runner (:mod:`.runner`), the GPU paths end to end
(:mod:`.check`), Multi30k quality and newstest2014 decoding (:mod:`.multi30k`), kernels in isolation (:mod:`.parts`).
"""
