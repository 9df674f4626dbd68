"""The C++ kernel for the hot CPU collectives: the library (``kernel.py``, ``_kernel.cpp``) and
the recorder's side of it (``bridge.py``)."""
