"""A plugin whose hook raises."""

import kpt


@kpt.hookimpl
def kpt_backends():
    raise RuntimeError("hook failed")
