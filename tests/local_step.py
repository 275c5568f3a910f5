"""A stand-in for the World's srun step, for tests without SLURM: one process that
starts one agent per "node" on this machine (MPLAUNCH_NODE_INDEX=i), waits for them,
and passes SIGTERM on, as srun does for its tasks. `wrap` runs each agent through a
command prefix (e.g. ``ip netns exec NAME``), to give each node its own address."""
import os
import signal
import subprocess
import sys


def starter(wrap=None):
    """A World(_starter=...) that starts the agents as children of one step process."""
    from mplaunch._engine.nodes.slurm_step import ProcessStep

    def start(agent_argv, env, nnodes, output):
        prefixes = [list(wrap(i)) if wrap else [] for i in range(nnodes)]
        argv = [sys.executable, __file__, repr(prefixes), *agent_argv]
        return ProcessStep(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                            stdout=output, stderr=output,
                                            start_new_session=True),
                           f"tests/local_step.py: {nnodes} local agent(s)")
    return start


def main():
    import ast
    prefixes = ast.literal_eval(sys.argv[1])
    argv = sys.argv[2:]
    procs = []
    for i, prefix in enumerate(prefixes):
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
