"""TensorRT engines for the worker: profiles, the engine cache, the precision step, the builder.

The pure logic (profiles, cache keys, precision) imports neither TensorRT nor
cuda-python, so it runs and is tested anywhere. Only :mod:`.builder`,
:mod:`.cuda` and the TensorRT backend import them, inside functions, so
``import splitstream`` never needs them (they come with ``pip install
'splitstream[tensorrt]'``).
"""
