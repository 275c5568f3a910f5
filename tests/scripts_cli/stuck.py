"""Every rank blocks in a function the timeout's stack summary must name."""
import time


def stuck_here():
    time.sleep(600)


stuck_here()
