"""The rank's process and its own children: taking the process over (worker), its
streams, serving a World's calls (serve), and the process group's story in four
modules: setting it up and tearing it down (procgroup), the rendezvous with mplaunch's
store and its key spaces (rendezvous), healing it for a World (heal: release, state,
rebuild) and the endpoints that tell the release which connections are the group's
(endpoints); torch's private APIs behind feature checks (torchapi), the pytest plugin's
rank side, and the `__main__` of its spawn/forkserver children (mp_main, script_main).
Imports only _wire and errors: a DataLoader worker of a rank never loads the launching
side."""
