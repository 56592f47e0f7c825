"""Records stored without a payload for size, in-process: reading the router's tag, and the comparison of
an answer with a recorded call whose response is not there (the real-process replay is in
``test_replay_payload_dropped``)."""

from __future__ import annotations

import numpy as np

from splitstream.common import tensors
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import PAYLOAD_DROPPED_TAG, dropped_payloads
from splitstream.replayer.compare import RESPONSE_NOT_RECORDED, Answer, Tolerance, compare_answers

TOL = Tolerance()


def answer(**outputs: np.ndarray) -> Answer:
    message = oip.ModelInferResponse(model_name="m", model_version="v1")
    for name, array in outputs.items():
        message.outputs.add(name=name, datatype=tensors.datatype_of(array), shape=list(array.shape))
        message.raw_output_contents.append(tensors.to_raw(array))
    return Answer(0, message.SerializeToString())


def test_the_dropped_payloads_tag_reads_as_names_and_sizes_and_a_malformed_size_still_names_the_payload() -> None:
    record = recorder_pb2.CallRecord(request_id="r")
    assert dropped_payloads(record) == {}
    record.tags[PAYLOAD_DROPPED_TAG] = "response:47185920,request:300000"
    assert dropped_payloads(record) == {"response": 47_185_920, "request": 300_000}
    record.tags[PAYLOAD_DROPPED_TAG] = "shadows[0].response:12, request"
    assert dropped_payloads(record) == {"shadows[0].response": 12, "request": -1}


def test_an_answer_is_not_compared_with_a_recorded_call_whose_response_was_dropped_but_its_status_is() -> None:
    recorded = Answer(0, None, response_recorded=False)
    replayed = answer(y=np.ones((2, 3), np.float32), label=np.zeros(2, np.int64))
    diff = compare_answers(recorded, replayed, TOL)
    assert (diff.outcome, diff.outputs, diff.not_compared) == ("not_compared", (), ("label", "y"))
    assert diff.not_compared_why == RESPONSE_NOT_RECORDED
    assert diff.severity() == (0, 0.0, 0.0)
    failed = compare_answers(recorded, Answer(3), TOL)  # OK -> INVALID_ARGUMENT is still a status change
    assert (failed.outcome, failed.status_change) == ("status_change", "OK->INVALID_ARGUMENT")
    undecodable = compare_answers(recorded, Answer(0, b"\xff\xff not a message"), TOL)
    assert (undecodable.outcome, undecodable.not_compared) == ("not_compared", ())
