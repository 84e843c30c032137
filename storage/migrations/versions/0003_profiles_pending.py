"""run profiles and pending checkpoint files

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "run_profiles",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("document", sa.JSON(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_run_profiles_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_run_profiles")),
    )
    op.create_table(
        "pending_checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pending_checkpoints")),
    )
    with op.batch_alter_table("pending_checkpoints") as batch:
        batch.create_index(batch.f("ix_pending_checkpoints_run_id"), ["run_id"], unique=False)
        batch.create_index(batch.f("ix_pending_checkpoints_sha256"), ["sha256"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("pending_checkpoints") as batch:
        batch.drop_index(batch.f("ix_pending_checkpoints_sha256"))
        batch.drop_index(batch.f("ix_pending_checkpoints_run_id"))
    op.drop_table("pending_checkpoints")
    op.drop_table("run_profiles")
