"""Shared test setup: the helpers in this folder (`distributed`, `models`, `reference`) import by name.

pytest puts this folder on sys.path (rootdir-relative "prepend" import mode); spawned ranks inherit
that path, so they can import the test modules that hold their worker functions.
"""
