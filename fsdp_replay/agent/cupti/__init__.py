"""CUDA kernels and copies captured with CUPTI (cupti-python, the ``gpu`` extra).

``activity.py`` runs the CUPTI session of a rank (kinds, buffers, flushes, external correlation
ids, standing aside for other profilers), ``records.py`` turns its records into the trace's
``kernels`` and ``copies`` rows, ``coexist.py`` finds the other CUPTI clients. This package is
imported only on a rank that trains on CUDA with ``--cupti`` not ``off`` (``agent/gpu_activity.py``
decides), never on the CPU; importing it does not import cupti-python, ``activity.py`` does.
"""
