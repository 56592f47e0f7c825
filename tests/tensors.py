"""Building requests from arrays in tests (and the benchmarks, which import from ``tests``).

Only tests and benchmarks build requests from NumPy arrays; the byte layout they use is
:mod:`splitstream.common.tensors`' (``to_raw``, ``datatype_of``, ``CONTENTS_FIELDS``), so what a
test sends is exactly what a worker decodes.
"""

from __future__ import annotations

import numpy as np

from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.tensors import CONTENTS_FIELDS, datatype_of, to_raw


def add_raw_input(request: oip.ModelInferRequest, name: str, array: np.ndarray) -> None:
    """Append ``array`` to ``request`` as a raw input."""
    request.inputs.add(name=name, datatype=datatype_of(array), shape=list(array.shape))
    request.raw_input_contents.append(to_raw(array))


def add_typed_input(request: oip.ModelInferRequest, name: str, array: np.ndarray) -> None:
    """Append ``array`` to ``request`` as typed contents."""
    datatype = datatype_of(array)
    field = CONTENTS_FIELDS.get(datatype)
    if field is None:
        raise TypeError(f"{datatype} cannot be sent as typed contents")
    tensor = request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
    values = array.reshape(-1).tolist()
    if datatype == "BYTES":
        values = [v.encode() if isinstance(v, str) else bytes(v) for v in values]
    getattr(tensor.contents, field).extend(values)
