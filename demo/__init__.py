"""The one-command demo: a real digit classifier in two versions behind splitstream."""
