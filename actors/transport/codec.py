"""The shm transport's wire: a step (SchedulerOutput) and a rank's answer, in kvcore/wire.py's marshal form.

The messages' fields travel as kvcore/wire.py derives them (marshal of the positional tuples, pickle for what
marshal would not write faithfully); this module only frames an answer: rank 0's ModelRunnerOutput, another
rank's None, or a step error (its text, and whether a collective failed); anything else goes as pickle.
"""

from __future__ import annotations

import marshal
import pickle
from typing import Any

from kvcore import wire
from kvcore.messages import ModelRunnerOutput, SchedulerOutput

# An answer's first item: rank 0's output is wire's marshal form (first item wire.PICKLED or wire.FIELDS);
# the other kinds follow those.
_NONE = max(wire.PICKLED, wire.FIELDS) + 1
_ERROR, _PICKLED = _NONE + 1, _NONE + 2
_NONE_ANSWER = marshal.dumps((_NONE,))  # a rank other than 0 answers (True, None)

encode_step = wire.writer(SchedulerOutput)
decode_step = wire.reader(SchedulerOutput)
_encode_output = wire.writer(ModelRunnerOutput)
_decode_output = wire.form_reader(ModelRunnerOutput)


# ---- the answer: (True, rank 0's ModelRunnerOutput | None) or (False, (error text, collective?)) ---
def encode_answer(ok: bool, payload: Any) -> bytes:
    if ok and payload is None:
        return _NONE_ANSWER
    if ok and type(payload) is ModelRunnerOutput:
        return _encode_output(payload)
    if not ok and type(payload[0]) is str and type(payload[1]) is bool:
        return marshal.dumps((_ERROR, *payload))
    return marshal.dumps((_PICKLED, pickle.dumps((ok, payload), protocol=pickle.HIGHEST_PROTOCOL)))


def decode_answer(data: bytes | memoryview) -> tuple[bool, Any]:
    f = marshal.loads(data)
    kind = f[0]
    if kind < _NONE:
        return True, _decode_output(f)
    if kind == _NONE:
        return True, None
    if kind == _ERROR:
        return False, (f[1], f[2])
    answer: tuple[bool, Any] = pickle.loads(f[1])
    return answer
