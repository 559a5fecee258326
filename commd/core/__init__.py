"""The op model: what a rank submits, what a matched op is, where a group lives."""
