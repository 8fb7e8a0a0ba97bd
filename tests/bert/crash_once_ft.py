"""examples/bert.py --fault-tolerant, except that replica group CRASH_GROUP kills itself (SIGKILL) in the forward of
step CRASH_AT_STEP (counted from 0), as a lost machine would."""

import os
import signal

from apps.bert import fault_tolerant, train


def main() -> None:
    real_loss = fault_tolerant.micro_batch_loss
    victim = os.environ["REPLICA_GROUP_ID"] == os.environ["CRASH_GROUP"]
    crash_at = int(os.environ["CRASH_AT_STEP"])

    def micro_batch_loss(steps, *args, **kwargs):
        if victim and steps.global_step >= crash_at:
            print(f"killed {os.environ['REPLICA_GROUP_ID']} in step {steps.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_loss(steps, *args, **kwargs)

    fault_tolerant.micro_batch_loss = micro_batch_loss
    train.main()


if __name__ == "__main__":
    main()
