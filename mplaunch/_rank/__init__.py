"""The rank's process and its own children: taking the process over (worker), its
streams, the env:// rendezvous, serving a World's calls (serve), the process group's
incarnations, release and rebuild for a healing World (pgroup), the pytest plugin's
rank side, and the `__main__` of its spawn/forkserver children (mp_main). Imports only
_wire and errors: a DataLoader worker of a rank never loads the launching side."""
