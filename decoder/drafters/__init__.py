"""Drafters: one module per source of drafts, each behind the `Drafter` interface
(`redraft.decoder.drafter`) and each holding its own algorithm.

Which drafters exist, their options and how to build them: `registry` (`REGISTRY`,
`build_drafter`); nothing else lists them.
"""
