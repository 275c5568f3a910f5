"""Imported in a rank only when its launched function is unpickled: its globals show
which environment the rank had at that moment."""
import os

RANK_AT_IMPORT = os.environ.get("RANK")
EXTRA_AT_IMPORT = os.environ.get("ENVCHECK_EXTRA")


def seen_at_import():
    return RANK_AT_IMPORT, EXTRA_AT_IMPORT, os.environ["RANK"]
