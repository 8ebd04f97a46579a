"""The grammar of `.pipe` files, installed as package data."""
