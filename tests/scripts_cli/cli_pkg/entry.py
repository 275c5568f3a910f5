"""Targets for `mplaunch package.module:function`."""
import json
import os
import sys


def main():
    print("ENTRY " + json.dumps({"rank": int(os.environ["RANK"]), "argv": sys.argv}))


def exit_four_in_rank_one():
    return 4 if os.environ["RANK"] == "1" else None


class Tool:
    @staticmethod
    def run():
        print(f"TOOL {os.environ['RANK']}")
        return "ignored: not an int"


not_callable = 3
