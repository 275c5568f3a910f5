"""The `__main__` of the processes a rank starts with spawn or forkserver (a DataLoader
worker, a Pool worker): the rank's `__main__.__spec__` names this module, so
multiprocessing runs it there as `__mp_main__` instead of the user's script, and it
becomes the rank's `__main__` again (see _wire.mainmod). Never imported by mplaunch itself.
"""
if __name__ == "__mp_main__":
    from mplaunch._wire.mainmod import fill_child_main
    fill_child_main(globals())
