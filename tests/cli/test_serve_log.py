"""`kvnotes serve`'s request log: the front's per-request lines reach stderr once."""

from __future__ import annotations

import json
import logging

from kvnotes.cli.serve import log_requests_to_stderr


def test_request_log_prints_each_front_line_once_on_stderr(capsys):
    front_log = logging.getLogger("kvnotes.serving.front")
    saved = (front_log.handlers[:], front_log.level, front_log.propagate)
    try:
        log_requests_to_stderr()
        logging.getLogger().setLevel(logging.WARNING)  # the root would drop INFO
        front_log.info("request %s", json.dumps({"id": "r1", "tenant": "acme",
                                                 "outcome": "spliced"}))
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("request ")
        assert json.loads(err[0].removeprefix("request ")) == {
            "id": "r1", "tenant": "acme", "outcome": "spliced"}
    finally:
        front_log.handlers[:], front_log.level, front_log.propagate = saved[0], saved[1], saved[2]
