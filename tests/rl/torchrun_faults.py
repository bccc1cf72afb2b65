"""Run by tests/rl/test_train_torchrun.py under torchrun: `rl.train`'s run with faults injected on rank 1 only,
given as a comma-separated list:

  nonfinite_loss  rank 1's second loss is NaN (its share of step 2)
  sync:N          rank 1's engine fails to install the adapter at its N-th install (1: rl.check's at the start,
                  then one per step that was not skipped)
"""

import sys

import rl.train as train
from rl.session import Session
from tests.rl.test_train import compose_cfg


def inject(s: Session, fault: str) -> None:
    calls = [0]
    fault, _, arg = fault.partition(":")
    if fault == "nonfinite_loss":
        real = train.policy_loss

        def policy_loss(*args, **kwargs):
            calls[0] += 1
            loss, metrics = real(*args, **kwargs)
            return (loss * float("nan") if calls[0] == 2 else loss), metrics

        train.policy_loss = policy_loss
    elif fault == "sync":
        real = s.engine.load_adapter

        def load_adapter(*args, **kwargs):
            calls[0] += 1
            if calls[0] == int(arg):
                raise RuntimeError("injected: the engine worker died while installing the adapter")
            return real(*args, **kwargs)

        s.engine.load_adapter = load_adapter
    else:
        raise ValueError(f"unknown fault {fault!r}")


if __name__ == "__main__":
    faults, *overrides = sys.argv[1:]
    with Session(compose_cfg(overrides)) as session:
        if session.rank == 1:
            for fault in faults.split(","):
                inject(session, fault)
        train.run(session)
