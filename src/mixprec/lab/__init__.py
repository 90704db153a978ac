"""The lab: built-in workloads, a trainer that runs them under each recipe, typed reports and the CLI."""
