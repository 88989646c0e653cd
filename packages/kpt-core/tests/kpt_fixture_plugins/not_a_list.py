"""A plugin whose hook returns one backend instead of a list of them."""

import kpt
from kpt.reference import ReferenceBackend


class Lone(ReferenceBackend):
    name = "fixture-lone"


@kpt.hookimpl
def kpt_backends():
    return Lone()
