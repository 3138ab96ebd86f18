"""Test doubles of the webui hosts, written from ../../shared/host-contract.md (see fixtures.py)."""
