"""A plugin whose hook returns something that is not a backend, and a backend whose name is taken."""

import kpt
from kpt.reference import ReferenceBackend


@kpt.hookimpl
def kpt_backends():
    return ["not a backend", ReferenceBackend()]
