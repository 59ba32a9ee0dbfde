# Sourced by the GPU check scripts (bash): `locked NAME` prints the version uv.lock pins
# for the package NAME (run from the repository root).
locked() {
    awk -v n="$1" '$0 == "name = \"" n "\"" {getline; gsub(/version = |"/, ""); print; exit}' uv.lock
}
