"""How `Launcher` supervises a parameter-server job (a separate chief task): the chief's
outcome is the job's, a worker that dies is restarted or left behind, a lost parameter
server should end the chief. `ChiefLedWaiting` is the mixin `Launcher` takes it from.
"""

from __future__ import annotations

import time
from typing import Optional

from tfdist.launcher.tasks import _Task


class ChiefLedWaiting:
    """`Launcher`'s waiting for parameter-server jobs, where the chief drives and the others follow it."""

    def _wait_chief_led(self) -> int:
        """Parameter-server jobs: the chief's outcome is the job's.

        A worker that dies is reported (and restarted up to --restart_workers
        times); training carries on without it. A parameter server that dies
        should make the chief fail; if the chief is still running
        `ps_loss_timeout_s` later, the launcher stops the job itself.
        """
        chief = next(t for t in self.tasks if t.role == "chief")
        reported: set[_Task] = set()
        ps_lost: Optional[tuple[_Task, float]] = None
        while chief.process.poll() is None:
            for i, task in enumerate(self.tasks):
                if task is chief or task.process.poll() is None or task in reported:
                    continue
                reported.add(task)
                code = task.process.returncode
                if task.role == "worker" and self._signal is None:
                    restarts = self.restarts.get(task.label, 0)
                    if restarts < self.restart_workers:
                        self.restarts[task.label] = restarts + 1
                        self._print(f"tfdist-launch: {task.label} {task.describe()}; restarting it "
                                    f"({restarts + 1} of {self.restart_workers}).\n")
                        task.reader.join(timeout=5)
                        self.tasks[i] = self._spawn(task.role, task.index, task.host)
                    else:
                        self._print(f"tfdist-launch: {task.label} {task.describe()}; the chief carries on "
                                    "with the other workers.\n")
                elif task.role == "ps" and code != 0 and ps_lost is None:
                    self._print(f"tfdist-launch: {task.label} {task.describe()}; the chief should now fail "
                                "(a parameter server holds part of the model).\n")
                    ps_lost = (task, time.time())
            if ps_lost and time.time() - ps_lost[1] > self.ps_loss_timeout_s:
                self._print(f"tfdist-launch: the chief did not stop within {self.ps_loss_timeout_s:.0f} s of losing "
                            f"{ps_lost[0].label}; stopping the job.\n")
                self._stop_all()
                return self._report(ps_lost[0], " (the job was stopped)")
            time.sleep(0.1)
        # The chief has finished: the others leave on their own within seconds.
        self._wait_all(self.grace_s)
        stragglers = [t.label for t in self.tasks if t.process.poll() is None]
        self._stop_all()
        if chief.process.returncode != 0:
            return self._report(chief, "")
        self._print(f"tfdist-launch: the chief finished; job done{self._aftermath(reported, stragglers)}.\n")
        return 0

    def _aftermath(self, reported: set[_Task], stragglers: list[str]) -> str:
        """What the other tasks did, for the closing line: "" when every one left cleanly after the chief.

        "Lost along the way" are the workers that ended with an error while the chief trained (and were
        not restarted); a task that failed or had to be stopped only after the chief finished is named
        apart, since the training itself did not miss it.
        """
        lost = [t.label for t in self.tasks if t in reported and t.role == "worker" and t.process.returncode != 0]
        late = [f"{t.label} {t.describe()}" for t in self.tasks
                if t.role != "chief" and t not in reported and t.label not in stragglers
                and t.process.returncode != 0]
        notes = []
        if lost:
            notes.append("lost along the way: " + ", ".join(lost))
        if late:
            notes.append("after the chief finished, " + ", ".join(late))
        if stragglers:
            notes.append(f"stopped {', '.join(stragglers)}, still running {self.grace_s:g} s after the chief finished")
        return f" ({'; '.join(notes)})" if notes else ""
