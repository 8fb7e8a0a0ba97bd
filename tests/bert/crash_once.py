"""examples/bert.py, except that on torchrun's first attempt rank CRASH_RANK kills itself (SIGKILL)
at the start of optimizer step CRASH_AT_STEP, as a lost machine or the OOM killer would."""

import os
import signal

from apps.bert import train


def main() -> None:
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    victim, crash_at = int(os.environ["CRASH_RANK"]), int(os.environ["CRASH_AT_STEP"])
    real_step = train.train_micro_step
    calls = 0

    def micro_step(*args, **kwargs):
        nonlocal calls
        calls += 1  # one micro-step per optimizer step in the tests that use this
        if attempt == 0 and rank == victim and calls == crash_at:
            print(f"killed rank {rank} in step {crash_at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_step(*args, **kwargs)

    train.train_micro_step = micro_step
    train.main()


if __name__ == "__main__":
    main()
