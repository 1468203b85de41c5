// A piece of a long row, for kernels that take rows longer than one workgroup's chunk in pieces (one
// workgroup per piece, rows after rows); mirrored by bg_piece in shaders/cuda/prelude.cuh.
struct Piece {
    row: u32,
    first: u32,    // the piece's first element, counted from the row's start
    count: u32,    // elements in the piece
    index: u32,    // row * chunks + piece
    valid: bool,   // false for workgroups past the last piece (they only take part in barriers)
}

// Workgroup `index`'s piece of `rows` rows of `length` elements cut into pieces of `chunk`.
fn piece_at(index: u32, rows: u32, length: u32, chunk: u32) -> Piece {
    let chunks = (length - 1u) / chunk + 1u;
    let clamped = min(index, rows * chunks - 1u);
    let first = (clamped % chunks) * chunk;
    return Piece(clamped / chunks, first, min(chunk, length - first), index, index < rows * chunks);
}
