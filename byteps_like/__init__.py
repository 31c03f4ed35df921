"""byteps_like"""
