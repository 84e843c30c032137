"""Shared test setup: process settings first (before torch loads), then common fixtures."""

from __future__ import annotations

from edgesplit.runtime import configure_process

configure_process()
