"""docs/sglang.md: the protocol SGLang 0.5.23 speaks, read from its source, so its numbers are
mostly settings (what the client sends, its deadlines) and SGLang's behaviour by reading. What
it measured is section 5's RL row, through our server and through SGLang."""

from .check import Figure, NotMeasured
from .common import COMMANDS, CONFIG, UNRECORDED

_DOC = "docs/sglang.md"
_FIRST, _SECOND = "rl_through_a_server/runs/0/", "rl_through_a_server/runs/1/"
_DEADLINE = "the client's default (rollouts/sglang.py, rollouts/sglang_engine.py)"
_ROUTER = "a deadline or setting of rollouts/router.py"
_SGLANG = "SGLang's behaviour, by reading its source"
_STATUS = "HTTP status codes, plural"

FIGURES = (
    Figure(_DOC, "held-out accuracy {} -> {}, and {} in a second run | {} -> {}, and {} in a "
           "second run |", COMMANDS,
           tuple(run + f"{server}/{field}" for run, server, field in (
               (_FIRST, "ours", "sft_accuracy"), (_FIRST, "ours", "rl_accuracy"),
               (_SECOND, "ours", "rl_accuracy"), (_FIRST, "sglang", "sft_accuracy"),
               (_FIRST, "sglang", "rl_accuracy"), (_SECOND, "sglang", "rl_accuracy"))),
           "{:.2f}"),
)

NOT_MEASURED = tuple(NotMeasured(_DOC, quote, why) for quote, why in (
    # 1. What the client sends
    ("`SamplingParams.temperature`; scoring 1.0", CONFIG),
    ("| ↳ `min_p` | 0.0 |", CONFIG),
    # 3. Behaviours the client relies on
    ("repeats every 0.5 s until they have returned", _DEADLINE),
    ("(`{\"abort_all\": true}`, every 0.5 s until it returns)", _DEADLINE),
    ("`health_timeout` 300 s)", _DEADLINE),
    ("so its `/health` takes at least 1 s", _SGLANG),
    ("(health check every 1 s, failure threshold 2,", _ROUTER),
    ("answers the same 400s", _STATUS),
    # 4. Deadlines the client applies: the table
    ("| `read_timeout` | 3600 s between bytes", _DEADLINE),
    ("| `connect_timeout` | 10 s |", _DEADLINE),
    ("| `control_timeout` | 600 s total per attempt |", _DEADLINE),
    ("| `retries`, `retry_backoff` | 2, 0.5 s doubling |", _DEADLINE),
    ("| `unavailable_wait` | 300 s | router 503s", _DEADLINE + "; " + _STATUS),
    ("| `health_timeout` | 300 s (`remote_engine`; `check_health` 30 s) | the wait for every "
     "worker's `/health` at start (503s and refused connections are waited out); 5 s when",
     _DEADLINE + "; " + _STATUS),
    ("| `abort_grace` | 1 s |", _DEADLINE),
    ("| router calls | 5 s `/workers`, 10 s `POST /workers`, 60 s `launch` |", _ROUTER),
    # 5. As tested
    ("SGLang after >= 1 s (3(d))", _SGLANG),
    ("(asks +0.15;", "the test's threshold; the measured gains beside it"),
    ("0.006-0.014 ours, bf16 exports; 0.005-0.017 SGLang, float32, read from the logs of the "
     "runs at commits 46cfb82 and 4d70973 and not recorded", UNRECORDED),
))
GENERATED = ()
