"""Adapters that run codagen's fused blocks inside other training frameworks (imported by name, never by the
package: ``codagen.integrations.torchtitan`` needs torchtitan)."""
