export async function loadCodec() { return null; }
