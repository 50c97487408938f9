"""One cache's files on disk: their names (paths), the SWMR segments and the finished file (segment), the
immutable parts many hosts publish (parts), and the unsealed-file probe run in a child process."""
