"""launch() across nodes, one launcher per node (a multi-node srun step, or a node rank
given by hand): how the nodes' launchers tell each other about a failure through the
store (sync), and what SLURM's environment says of a task's place (slurm). The World
across nodes is another mechanism: _engine.nodes."""
