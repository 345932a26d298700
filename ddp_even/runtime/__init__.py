"""One rank's epoch at run time: reading ahead, the three epoch shapes, statistics."""
