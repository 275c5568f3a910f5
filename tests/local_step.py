"""A stand-in scheduler for tests without SLURM or Ray: scheduler="local" starts one
agent per "node" on this machine, as children of one step process that hands each its
index (MPLAUNCH_NODE_INDEX=i), waits for them, and passes SIGTERM on, as srun does for
its tasks. It goes through the seam every scheduler does (_engine.nodes.schedulers):
importing this module registers it. ``local_wrap=`` (its own World option) runs each
agent through a command prefix (``wrap(i)``, e.g. ``ip netns exec NAME``) to give each
node its own address."""
import os
import signal
import subprocess
import sys


class Local:
    name = "local"
    about = "agents on this machine, one per stand-in node (mplaunch's tests)"
    options = ("local_wrap",)

    def __init__(self):
        self.wrap = None

    def check(self, nnodes, nprocs, gpus, options):
        self.wrap = options.get("local_wrap")
        if self.wrap is not None and not callable(self.wrap):
            raise TypeError(f"local_wrap must be callable, got {self.wrap!r}")

    def address(self):
        return None

    def start(self, launch):
        return self._step({i: list(self.wrap(i)) if self.wrap else []
                           for i in range(launch.nnodes)}, launch, self._replace)

    def _replace(self, index, launch, nodes):
        """A lost node's agent again, on this machine (as the same node, back)."""
        return self._step({index: list(self.wrap(index)) if self.wrap else []}, launch)

    @staticmethod
    def _step(prefixes, launch, replace=None):
        from mplaunch._engine.nodes.agents import ProcessStep
        argv = [sys.executable, __file__, repr(prefixes), *launch.argv]
        proc = subprocess.Popen(argv, env=launch.env, stdin=subprocess.DEVNULL,
                                stdout=launch.output, stderr=launch.output,
                                start_new_session=True)

        def cancel(_nodes):
            """As scancel ends a step: every process of it, stopped ones too (its
            session's group: the step process and its agents; their servers and ranks
            end with their agent)."""
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return True
        return ProcessStep(proc, f"tests/local_step.py: agent(s) of node(s) "
                                 f"{sorted(prefixes)}", cancel, step_replace=replace)

    def node_environ(self, agent_environ):
        return dict(agent_environ)


class NoSpare(Local):
    """The stand-in with no node to replace a lost one with: its replacement's part-step
    ends at once, saying so (as srun does with no node free)."""

    def _replace(self, index, launch, nodes):
        from mplaunch._engine.nodes.agents import ProcessStep
        return ProcessStep(subprocess.Popen(["sh", "-c", "echo no node free >&2; exit 1"],
                                            stdout=launch.output, stderr=launch.output),
                           "sh: no node free")


def register(name="local", scheduler=Local):
    """Register `scheduler` (a class offering the seam) under `name`."""
    from mplaunch._engine.nodes import schedulers
    if scheduler.name != name:
        scheduler = type(scheduler.__name__, (scheduler,), {"name": name})
    schedulers.register(name, scheduler, replace=True)


def main():
    import ast
    prefixes = ast.literal_eval(sys.argv[1])   # {node index: command prefix}
    argv = sys.argv[2:]
    procs = []
    for i, prefix in prefixes.items():
        env = dict(os.environ, MPLAUNCH_NODE_INDEX=str(i))
        procs.append(subprocess.Popen(prefix + argv, env=env))

    def forward(signo, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signo)
    signal.signal(signal.SIGTERM, forward)
    codes = [p.wait() for p in procs]
    sys.exit(max(codes) if codes else 0)


if __name__ == "__main__":
    main()
else:
    register()
