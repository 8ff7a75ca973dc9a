"""A worker's failure record is also torch's error file (``TORCHELASTIC_ERROR_FILE``):
torch's shape, what torch's ``@record`` wrote kept, and the copy a failed job leaves in
the launcher's own ``TORCHELASTIC_ERROR_FILE`` (torchrun's ``dump_error_file``).
In-process: the launches are in test_torch_agent.py."""

from __future__ import annotations

import json
import time

import pytest

from jdist.launch._blame import (
    candidate,
    error_file_env,
    read_record,
    recording_failures,
    reply_to_parent,
)
from jdist.launch._worker_group import Failure, describe_exit


def _raise_in(path, exc):
    with pytest.raises(type(exc)), recording_failures(error_file_env(str(path))):
        raise exc


def test_one_file_under_both_names():
    assert error_file_env("/x/rank_3.json") == {"JDIST_ERROR_FILE": "/x/rank_3.json",
                                                "TORCHELASTIC_ERROR_FILE": "/x/rank_3.json"}


def test_record_has_torchs_shape(tmp_path):
    """What torch's ErrorHandler.record_exception writes: message "Type: text",
    extraInfo.py_callstack and an integer timestamp string."""
    path = tmp_path / "rank_0.json"
    before = int(time.time())
    _raise_in(path, RuntimeError("sad because i throw"))
    data = json.loads(path.read_text())
    message = data["message"]
    assert message["message"] == "RuntimeError: sad because i throw"
    assert before <= int(message["extraInfo"]["timestamp"]) <= time.time()
    assert "RuntimeError: sad because i throw" in message["extraInfo"]["py_callstack"]
    rec = read_record(str(path))
    assert rec["type"] == "RuntimeError" and rec["text"] == "sad because i throw"
    assert rec["exit_code"] == 1 and rec["own"]


def test_what_torchs_record_wrote_is_kept(tmp_path):
    """A program's own torch-shaped record (``@record`` writes it before re-raising)
    keeps its message; jdist adds its precise time to it."""
    path = tmp_path / "rank_1.json"
    theirs = {"message": {"message": "ValueError: from record",
                          "extraInfo": {"py_callstack": "their stack", "timestamp": "17"}}}
    path.write_text(json.dumps(theirs))
    _raise_in(path, ValueError("from record"))
    data = json.loads(path.read_text())
    assert data["message"] == theirs["message"]
    assert data["time"] > 17 and data["type"] == "ValueError"


def test_a_torch_only_record_counts_once_the_process_failed(tmp_path):
    """A record only in torch's shape (no jdist fields) is read from its message; it
    names the failure only once the process exited non-zero."""
    path = tmp_path / "rank_2.json"
    path.write_text(json.dumps({"message": {
        "message": "KeyError: 'x'", "errorCode": 3,
        "extraInfo": {"py_callstack": "Traceback ...\nKeyError: 'x'\n",
                      "timestamp": "1700000000"}}}))
    rec = read_record(str(path))
    assert (rec["time"], rec["type"], rec["text"], rec["exit_code"], rec["own"]) == (
        1700000000.0, "KeyError", "'x'", 3, False)
    assert candidate(2, str(path), None, 5.0, describe_exit) is None  # still running
    assert candidate(2, str(path), 0, 5.0, describe_exit) is None  # it succeeded
    c = candidate(2, str(path), 3, 5.0, describe_exit)
    assert (c.time, c.how, c.exit_code) == (1700000000.0, "raised KeyError: 'x'", 3)


def test_reply_to_parent_copies_the_rank_record(tmp_path):
    """torch's dump_error_file: the failed rank's record, errorCode = its exit code."""
    attempt = tmp_path / "errors" / "attempt_1"
    attempt.mkdir(parents=True)
    _raise_in(attempt / "rank_3.json", RuntimeError("boom"))
    reply = tmp_path / "reply.json"
    failure = Failure(3, 1, 0, 1, "raised RuntimeError: boom", "", 1, time.time())
    reply_to_parent({"TORCHELASTIC_ERROR_FILE": str(reply)}, failure,
                    str(tmp_path / "errors"))
    message = json.loads(reply.read_text())["message"]
    assert message["message"] == "RuntimeError: boom" and message["errorCode"] == 1
    assert "raise exc" in message["extraInfo"]["py_callstack"]


def test_reply_to_parent_without_a_record(tmp_path):
    """A rank killed by a signal (no record), or a rank of another node (its launcher
    sent what it knew): the message says what the launcher knows."""
    reply = tmp_path / "reply.json"
    env = {"TORCHELASTIC_ERROR_FILE": str(reply)}
    killed = Failure(1, 1, 0, 137, "was killed by signal SIGKILL", "last line\n", 0, 17.5)
    reply_to_parent(env, killed, str(tmp_path))
    message = json.loads(reply.read_text())["message"]
    assert message == {"message": "rank 1 was killed by signal SIGKILL", "errorCode": 137,
                       "extraInfo": {"py_callstack": "last line\n", "timestamp": "17"}}
    remote = Failure(5, 1, 1, 1, "raised ValueError: far", "", 0, 20.0, "Traceback\n")
    reply_to_parent(env, remote, None)
    message = json.loads(reply.read_text())["message"]
    assert message["message"] == "ValueError: far" and message["errorCode"] == 1
    assert message["extraInfo"]["py_callstack"] == "Traceback\n"


def test_no_reply_without_the_variable(tmp_path):
    reply_to_parent({}, Failure(0, 0, 0, 1, "exited with code 1", "", 0), str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_reply_to_parent_copies_a_string_message_as_it_is(tmp_path):
    """torch's newer error-file format (``message`` a string) is copied unchanged, as
    torch's dump_error_file does (no errorCode to set in it)."""
    attempt = tmp_path / "attempt_0"
    attempt.mkdir()
    (attempt / "rank_0.json").write_text(json.dumps({"message": "custom text"}))
    reply = tmp_path / "reply.json"
    reply_to_parent({"TORCHELASTIC_ERROR_FILE": str(reply)},
                    Failure(0, 0, 0, 1, "exited with code 1", "", 0, 1.0), str(tmp_path))
    assert json.loads(reply.read_text()) == {"message": "custom text"}
